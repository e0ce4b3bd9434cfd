"""Planning before anything is allocated: the memory plan and stacking (plan), `:sharding
auto`'s candidates and their predicted memory and time (layout_plan), the choice among them
on the run's own devices (layout_choice), and a GPU's step time on paper (gpu_cost)."""
