"""How much to draft: one prober with back-off and one cost model for budgets, tree sizes and
shares, fed by measured step costs."""
