"""Offline calibration tools that write JSON configs (``attnkit calibrate ...``).

- :mod:`attnkit.calibrate.patterns`: MInference's kernel-aware search of a sparse pattern per head.
"""
