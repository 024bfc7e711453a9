"""Generated control-plane modules (python proto/generate.py); do not edit by hand."""
