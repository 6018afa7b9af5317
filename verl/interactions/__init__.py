"""verl's interaction hooks under verl's own module path: a class written against ``verl.interactions.base.
BaseInteraction`` runs here unchanged (``rollout.multi_turn.interaction_config_path``; docs/environments.md)."""
