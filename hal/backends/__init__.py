"""Built-in backends: cuda, ascend, mlu (vendor adapters) and fake (host memory)."""
