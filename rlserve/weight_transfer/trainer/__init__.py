"""The trainer's half of the weight transfer: what a training process imports to join the
server's group and send its weights. It imports the shared layer, never the server half."""
