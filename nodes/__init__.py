"""ComfyUI nodes (thin: widgets → frozen configs → one library call). Imported by the root
``__init__`` only when ComfyUI itself loads this folder."""
from . import flexvar_nodes, hart_nodes, infinity_nodes, var_nodes

var_nodes.register_model_folder(var_nodes.FOLDER)            # models/var
var_nodes.register_model_folder(infinity_nodes.FOLDER)       # models/infinity
var_nodes.register_model_folder(hart_nodes.FOLDER)           # models/hart
var_nodes.register_model_folder(flexvar_nodes.FOLDER)        # models/flexvar

NODES = var_nodes.NODES[:1] + infinity_nodes.NODES + hart_nodes.NODES + flexvar_nodes.NODES + var_nodes.NODES[1:]

# V3 node classes registered through the classic mapping (works on ComfyUI 0.3.64 and later).
NODE_CLASS_MAPPINGS = {n.define_schema().node_id: n for n in NODES}
NODE_DISPLAY_NAME_MAPPINGS = {n.define_schema().node_id: n.define_schema().display_name for n in NODES}
