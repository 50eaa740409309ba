"""ComfyUI nodes (thin: widgets → frozen configs → one library call). Registered by the root
``__init__`` only inside ComfyUI; the node set arrives with the ComfyUI issue."""
NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
