"""Post-training after SFT: preference tuning (DPO) and reinforcement learning with verifiable rewards (GRPO).

    losses.py       DPO's sigmoid and IPO losses, GRPO's group advantages and clipped policy loss (TRL's conventions)
    preferences.py  a JSON Lines file of preference pairs: checked, rendered with the chat template, masked, batched
"""
