"""The package version (one place: the package, calibration files and result rows all read it)."""

__version__ = "0.1.0"
