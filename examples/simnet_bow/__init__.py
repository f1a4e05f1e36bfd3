"""SimNet-BOW: pairwise query/title matching on bag-of-words LoD sequences (a parameter-server model)."""
