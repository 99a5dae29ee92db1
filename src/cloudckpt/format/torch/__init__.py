"""torch's archive format: zip records, the archive writer, the unpickling boundary."""
