"""The model a run leaves: the architectures, pretrained weights, class names, the saved files and
loading a run (or a pretrained model) for prediction; used by training and prediction alike."""
