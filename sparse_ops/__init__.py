"""Plain functions over tensors used by the models and policies (attention dispatch, gather/scatter)."""
