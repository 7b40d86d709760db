"""The update: one policy's training step on a batch of episodes. Each stage imports only the stages below it:

    learner.py       Learner.train(policy, episodes, group_index): the batch, the minibatch loop, the optimizer step
    batches.py       episodes -> a TrainBatch: group baselines, or advantages from the critic (PPO / T-PPO)
    passes.py        the no-gradient forwards: old and reference logprobs, the critic's values, in token budgets
    balance.py       a minibatch's rows moved between workers so each holds about the same tokens
    policy_state.py  one policy's state: adapter tensors, critic, AdamW, version
    optimizer.py     AdamW's flat gradient buffers, warm-up, moments held from the start, steps that skip a model
    train_batch.py   TrainBatch: sequences and per-token tensors; minibatches of whole episodes
    loss.py          the policy loss of a micro-batch (the registered policy loss, KL, TIS)
    critic.py        the value model and its loss
    forward.py       the decoder's forward and chunked token logprobs
    sequences.py     SequenceBatch and the layouts of per-token values (the data every stage shares)

docs/architecture.md draws the whole step.
"""
