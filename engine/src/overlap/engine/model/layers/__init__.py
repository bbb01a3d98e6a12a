"""The building blocks every model family's forward is made of: linear projections, RMSNorm, rotary embeddings with
the K/V write, paged attention, the gated MLP. Each holds its weights and the kernel that runs it on this machine;
a tensor-parallel variant replaces one of them, never the model's forward."""
