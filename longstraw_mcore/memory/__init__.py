"""The `memory` switches at run time (config/memory.py; modelled in planner/memory.py):

    layers.py    memory.recompute=layer and state staging around every decoder layer; the MLA query block
    staging.py   where a layer's prompt state lives between its runs (host memory, fp8 blocks) and how it
                 is brought to the device while the layer runs
    fp8.py       float8 e4m3 rows with a float32 scale per block of 128 values
    host_heap.py   memory.host_heap: whether glibc keeps freed host memory for the next step (CPU runs)
    grad_stage.py  memory.grad_offload: each gradient to a host buffer as autograd completes it (train/zero2.py
                 reduces from there)

The optimizer's offload lives with the optimizers (train/trainer.py `offload_kwargs`: Megatron's
HybridDeviceOptimizer; train/zero2.py: the micro_step shards in host memory)."""
