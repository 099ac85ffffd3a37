"""Drafting: KV selection policies for self-drafting, their page helpers, the draft-model drafter
and draft trees."""
