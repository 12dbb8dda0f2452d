"""radixserve as an NVIDIA Dynamo worker: `python -m radixserve.dynamo` (worker.py) registers
an engine with Dynamo's runtime, serves token ids in and out (request.py maps Dynamo's
preprocessed requests onto the engine's), and relays the engine's KV events to Dynamo's KV
router, so `python -m dynamo.frontend --router-mode kv` routes to radixserve workers."""
