"""tomlens.figures"""
