"""The compiler: a model or program in, one plan per worker out (pipeline.py lists the passes)."""
