"""The contracts between jetrl services: control messages, the trajectory codec, subject names.

Pure data: nothing here does I/O or imports torch.
"""
