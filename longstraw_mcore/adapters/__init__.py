"""LoRA / QLoRA adapters on the frozen base, in Hugging Face PEFT's format (`adapter` config section).

    sites.py     where each Hugging Face module an adapter may target lives in the Megatron model
    lora.py      the tensor-parallel LoRA term on Megatron's projections (forward hooks), its table
    attach.py    freeze the base, build this rank's adapter shards, `model.adapters`
    peft_io.py   PEFT directories in and out; whole adapters gathered from their shards
"""
