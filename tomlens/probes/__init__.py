"""tomlens.probes"""
