"""The Qwen2 policy: its forward pass (``model``), built from one decoder layer (``layer``), attention and its
registries (``attention``) and LoRA applied (``lora``) over params described once (``specs``, the LoRA adapter as its
own subtree); attention kernels (``flash``, ``kernels``), logical axes and their mesh (``axes``, ``sharding``) and
Hugging Face conversion (``hf``). Imports only the package's root."""

from lspo_jax import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "forward": "model",
        "init_params": "specs",
        "init_lora": "specs",
        "load_pretrained": "hf",
        "save_pretrained": "hf",
    },
)
