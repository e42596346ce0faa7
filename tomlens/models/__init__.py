"""tomlens.models"""
