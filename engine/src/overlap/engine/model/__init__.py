"""The model: loading Hugging Face folders (`loader`), the torch runner and its sampler, the native decode-attention
kernel, the tiny default model's builder and the simulated device (`sim_runner`)."""
