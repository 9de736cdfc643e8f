"""Layer 2, the distributed harness: rank pools (gloo on the CPU, NCCL on GPUs), the
tensor/sequence-parallel sharding jobs, sharded models, token-split controls and the
recorded parallelism verdicts. Imports the layers below."""
