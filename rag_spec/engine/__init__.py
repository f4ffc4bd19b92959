"""The decode loop: prefill, draft, one forward pass over the tree, verify, commit; its parts
live below it (verify/, cache/, forward/) and the drafters beside it read those parts."""
