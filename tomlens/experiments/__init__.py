"""tomlens.experiments"""
