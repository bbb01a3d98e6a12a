"""The OpenAI API's requests as Overlap reads them, shared by the pod's sidecar and the router (which scores a request
on the tokens the replica will cache): `schemas` (request bodies), `tools` (tool calls: shown to the chat template,
and read back from the output) and `text` (the model's tokenizer and chat template). It imports nothing else of
Overlap, so the sidecar and the gateway both may import it and stay independent of each other."""
