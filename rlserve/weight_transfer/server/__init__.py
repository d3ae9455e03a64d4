"""The server's half of the weight transfer: what each rank runs to join the trainer's group,
vet an update against the model and receive it. It imports the shared layer, never the
trainer half."""
