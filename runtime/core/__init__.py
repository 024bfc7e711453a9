"""The shared core both sides import (docs/architecture.md, "Packages"): tensor specs and their
wire form, the dataflow graph, the instruction set, the job configuration, exported-graph loading,
memory accounting and optimizers by name. It imports nothing from the client, the worker or the
controller."""
