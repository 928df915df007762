"""EAGLE-style draft heads: the model (model.py) and its checkpoint format (checkpoint.py)."""
