"""On-disk and on-the-wire formats: what a chunk's identity, a record, a segment file, a
compressed payload, the journal and a remote value look like, and the safe ways to open the
files that hold them. Nothing here knows the index or a tier."""
