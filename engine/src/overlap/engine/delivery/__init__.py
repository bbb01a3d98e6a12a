"""Model delivery: `model.uri` (hf://, s3://, gs://, https://, pvc://) parsed, fetched into a per-node or shared
cache once, verified against the source's hashes, and moved into place atomically (`overlap model fetch`)."""
