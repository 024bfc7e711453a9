"""Data-plane transports (gloo, NCCL, CUDA IPC) behind one small interface (gloo.py)."""
