"""Role logic: actor, critic, reference, reward."""
