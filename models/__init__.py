"""Model families (one file each) and the official-checkpoint loaders."""
from .loading import describe_checkpoint, load_var_transformer, load_var_vqvae, read_state_dict
from .var import VAR_PRESETS, VAR_SCHEDULES, VARAdapter, VARTransformer
from .vqvae import MultiScaleVQVAE

__all__ = ["VARTransformer", "VARAdapter", "MultiScaleVQVAE", "VAR_PRESETS", "VAR_SCHEDULES",
           "load_var_transformer", "load_var_vqvae", "read_state_dict", "describe_checkpoint"]
