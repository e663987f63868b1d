"""Training scripts bundled with hgtrain (synthetic data, no download).
"""
