"""Local-training backends: how a round's clients train (sequential reference, vectorized), with the objectives, flat
parameters, precision and augmentation they share."""
