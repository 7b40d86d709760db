"""Episode producers: each turns problems into episodes (allsync.episodes) with the rollout engine. A run's
`producer:` section names one (`producer.kind`); its other keys are the fields of that producer's settings class.

    single_turn.py  one prompt, group_size answers (DAPO, GRPO, Dr.GRPO): the default
    windows.py      PPO / T-PPO: responses generated a window of tokens per step, trained with a critic
    multiconv.py    multi-conversation DAPO: chunks read one at a time, a memory carried between them
    agent.py        multi-turn tool agents: an environment answers each reply until it says done
    groups.py       dynamic sampling (keep groups whose metric varies, refill) around any group producer
    registry.py     the registry and what a producer's settings class provides

To add a producer: one module here, or one of your own named in run.imports, with its settings class under
`@register_producer`, subclassing ProducerDefaults (registry.py says what it provides); every module of this folder
is imported when a config is read. The update (allsync/update/learner.py) consumes episodes and never knows which producer
made them: what it asks of one (the loss's aggregation, the rows that train) it asks the settings.
"""
