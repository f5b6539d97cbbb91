"""Where state lives: the client-state stores (memory, disk), checkpoints and the memory budget that decides between them."""
