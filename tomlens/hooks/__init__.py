"""tomlens.hooks"""
