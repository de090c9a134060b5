"""qshard.integrations: bridges from other training stacks.

* :mod:`qshard.integrations.deepspeed` — read a DeepSpeed config into qshard's
  (:func:`~qshard.integrations.deepspeed.read_deepspeed_config`).

Hugging Face ``transformers`` models need no bridge: ``qshard.shard`` finds their decoder
layers (``examples/hf_llama.py``).
"""

__all__: list[str] = []
