"""Drafting: KV selection policies for self-drafting, their page helpers, and the draft-model drafter."""
