"""The Qwen2 policy: its forward pass (``model``) with the LoRA adapter as its own subtree, attention kernels
(``flash``, ``kernels``), logical axes and their mesh (``axes``, ``sharding``) and Hugging Face conversion
(``hf``). Imports only the package's root."""

from lspo_jax import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "forward": "model",
        "init_params": "model",
        "init_lora": "model",
        "load_pretrained": "hf",
        "save_pretrained": "hf",
    },
)
