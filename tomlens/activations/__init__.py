"""tomlens.activations"""
