"""Everything that trains drafts (the draft head, exit adapters) and their data. Serving only
loads what was trained here (``rag-spec draft train``)."""
