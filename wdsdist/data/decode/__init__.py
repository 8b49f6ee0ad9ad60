"""Bytes to tensors: a sample's image and label checked and decoded (sample), and the training
crop decoded from the JPEG's region alone (jpegcrop, with jpegcrop.c)."""
