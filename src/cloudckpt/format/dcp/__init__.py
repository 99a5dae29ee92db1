"""What a DCP checkpoint holds on storage: its layout, ``.metadata``, the layout index,
the tensor archives inside data objects, and the checksums of what a load reads.

Codecs only (no I/O): the writer and reader in :mod:`cloudckpt.dcp` use them.
"""
