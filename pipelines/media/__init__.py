"""Media helpers: locating ffmpeg, probing and decoding in a killable worker, cutting clips."""
