"""Everything that patches or registers with transformers, through one patch registry."""
