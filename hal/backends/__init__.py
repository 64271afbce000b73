"""Built-in backends: cuda, ascend, mlu (vendor adapters) and fake (host memory).

``_native`` holds the plumbing that ascend and mlu share.
"""
