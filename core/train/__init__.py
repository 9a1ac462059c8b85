"""Training draft heads: answers and features, the batch generator, losses, the training loop."""
