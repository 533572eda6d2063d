#!/usr/bin/env bash
# Everything this repository measures on a GPU machine, as stages of one script:
#
#   OUT=/somewhere bash benchmarks/device.sh STAGE [STAGE...]
#
# Stages run in the order given; each writes under $OUT and prints a short summary.
#   main        the README's main job exactly as written: bash examples/pretrain_llama.sh
#               (TRAIN_ITERS, FLUX_BACKEND, MODEL_CONFIG pass through)      -> main.log
#   tests       every GPU-marked test on the visible GPUs (TESTS_PATHS narrows it; tests that
#               need more GPUs skip)                               -> tests-gpu.{json,log}
#   bench       the op benchmark, m >= 1024 grid (BENCH_M_SET=small|all for others) with the
#               table that matches the machine, CUDA_DEVICE_MAX_CONNECTIONS=1 (BENCH_CONNECTIONS
#               overrides; "unset" leaves it unset)                 -> bench.{json,png,log}
#   unseen      the op benchmark on models no table has seen (UNSEEN_MODELS, NAME:H:FC1:FFN each;
#               UNSEEN_MS; UNSEEN_EXTRA: more bench arguments, e.g. "--models llama3-8b" for grid
#               models beside them), nccl, flux and auto         -> bench-unseen.{json,png,log}
#   ab          an A/B of a config change against the table: AB_VARIANT=<JSON file> (e.g.
#               benchmarks/variants/gluon-pingpong.json; AB_CASES: the bench's case arguments
#               instead of the m >= 1024 grid), with the same-config control that
#               `python -m megatron_flux.tools.tune.adopt` needs           -> ab.{json,png,log}
#   kvc         communication off, one GPU: the fused kernels with the table's configs (TP
#               KVC_TP, default 2) against cuBLAS, launches alternating, m >= 1024 (KVC_OPS: one
#               op; KVC_CASES: other shapes and configs; KVC_EXTRA: a JSON list of config
#               changes, kernel_vs_cublas --extra; KVC_NAME: a file suffix)
#                                                          -> kvc-{ag,rs}[-NAME].{json,log}
#   tune        megatron-flux tune over the grid (all m; TUNE_ARGS: other cases and search
#               sizes, e.g. --time-budget-s; TUNE_RESUME: an earlier call's tune/table.json to
#               continue), then the grid benchmark with the new table (TUNE_BENCH=0: not)
#                                                  -> tune/{table.json,tune.log,bench.json,bench.png}
#   trainshapes a training config's TP GEMMs (TRAIN_CONFIG, default configs/llama3_8b_16l.json) at
#               TRAIN_MS (default "4096 8192"): tuned (TRAIN_TUNE_BUDGET s, TRAIN_CANDIDATES per
#               entry), added to this machine's shipped table where it lacks them
#               (tools.tune.add), benchmarked with that table, and the table confirmed with the
#               benchmark (tools.tune.confirm): what shipping them takes, in one call
#               -> train/{tune.json,added.json,bench.json,confirmed.json,*.log}
#   modelbench  the op benchmark of TRAIN_CONFIG's TP GEMMs at TRAIN_MS with the tables as found
#               (before trainshapes tunes them)                    -> model-bench.{json,png,log}
#   race        a workspace growth while one rank's GPU is still busy (RACE_SLEEP_CYCLES of GPU
#               sleep, default about 6 s), with and without the device drain before the rendezvous
#               (benchmarks/experiments/growth_race.py)                         -> race.{jsonl,log}
#   rstrace     where the fused GEMM+RS's time goes with communication on and off, every rank
#               (benchmarks/experiments/phase_trace_tp.py; RSTRACE_MODELS, NAME:H:FC1:FFN each,
#               default the weakest held-out GEMM+RS cases; RSTRACE_MS, default "1024 2048")
#                                                           -> rs-trace-{on,off}.{json,log}
#   host        host time per layer call of megatron-core's own linears, nccl and flux
#               (benchmarks/host_overhead.py --layers, m = 4096 and 8192), with a profile of
#               flux's host path                                    -> host.{json,log}
#   sections    where a layer call's host time goes, section by section, nccl and flux
#               (benchmarks/experiments/host_sections.py, m = 4096)           -> sections.{json,log}
#   launchab    host time per layer call of the launch paths, alternating in one process:
#               megatron-core's own linears, nccl, flux with the raw C launch, through
#               CompiledKernel.run, through Triton
#               (benchmarks/experiments/host_launch_ab.py, m = 4096)         -> launch-ab.{json,log}
#   matrix      the end-to-end matrix's cells MATRIX_CELLS (benchmarks/e2e_matrix.py; MATRIX_ARGS
#               pass through; MATRIX_RESUME: an earlier call's matrix/ to resume from)                              -> matrix/<cell>.json, matrix-meta.json
#   interleave  the training job with the backends rotated in one process
#               (benchmarks/device_interleave.sh; IL_* variables pass through)  -> interleave/
#   e2e         stock, nccl and flux as separate training runs, losses compared
#               (benchmarks/e2e_device.sh; E2E_* variables pass through)          -> e2e/
#   cachepack   the Triton cache as $OUT/triton-cache.tgz.part-* (15 MB pieces)
#   bundle      everything under $OUT so far but the cache pack and smi.csv, moved into one archive
#               (a remote-device tool may return only a few files, none deep in folders)
#                                                                        -> results.tgz
#
# TP is every local GPU (NGPUS overrides). A machine with no network needs megatron-core 0.19
# as a wheel in .whl/ (main, tests, matrix, interleave, e2e install it into /tmp/site and put it on PYTHONPATH). A Triton cache
# from an earlier `cachepack`, put back into .device/, is unpacked first and saves the compiles.
# With a remote-device tool that copies this tree to the machine and returns $OUT: carry `.whl`
# and `.device`, check first that the copy fits (`python benchmarks/device_copy_size.py .device
# .whl`), and whether the carried cache still matches the kernels (`python
# benchmarks/kernel_manifest.py --check .device/`); end a call that compiled new kernels with
# `cachepack`. Per-stage time limits: MAIN_TIMEOUT, TESTS_TIMEOUT, BENCH_TIMEOUT, KVC_TIMEOUT,
# TUNE_TIMEOUT (seconds).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/megatron-flux-device}"
mkdir -p "${OUT}"
[ "$#" -gt 0 ] || { awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 2; }
source benchmarks/device_env.sh
gpu_session_start

TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}")  # one process per GPU
train_cfg="${TRAIN_CONFIG:-configs/llama3_8b_16l.json}"; train_ms="${TRAIN_MS:-4096 8192}"  # trainshapes, modelbench

use_carried_megatron() {  # megatron-core 0.19 from the carried wheel, on PYTHONPATH
    if compgen -G ".whl/megatron_core-0.19*.whl" > /dev/null; then
        install_carried_wheels ".whl/megatron_core-0.19*.whl" && export PYTHONPATH="/tmp/site:${PYTHONPATH}"
    fi
}

with_connections() {  # with_connections CMD...: CMD under BENCH_CONNECTIONS (default 1); with
    # "unset" the fused backend is allowed several hardware queues (the benchmark runs no other
    # rank-spanning kernel beside a fused one; docs/design.md, "Known limits")
    if [ "${BENCH_CONNECTIONS:-1}" = unset ]; then
        env -u CUDA_DEVICE_MAX_CONNECTIONS MEGATRON_FLUX_ALLOW_SEVERAL_QUEUES=1 "$@"
    else
        CUDA_DEVICE_MAX_CONNECTIONS="${BENCH_CONNECTIONS:-1}" "$@"
    fi
}

tune_table() {  # tune_table OUT_JSON ARGS...: megatron-flux tune with ARGS (what and how much to
    # search) and the short timings every table here is tuned with, under TUNE_TIMEOUT (300 s)
    # -> the table OUT_JSON, its log tune.log beside it. TUNE_RESUME: a table an earlier call's
    # tune wrote (carried): its entries are kept and not tuned again (a search longer than a call)
    local out_json="$1"; shift
    local fresh=(--no-merge)
    if [ -n "${TUNE_RESUME:-}" ]; then
        cp "${TUNE_RESUME}" "${out_json}" && fresh=(--skip-tuned) || return 1
    fi
    timeout "${TUNE_TIMEOUT:-300}" "${TORCHRUN[@]}" -m megatron_flux.tools.cli tune "$@" \
        --screen-iters 5 --trials 3 --iters 10 --no-progress "${fresh[@]}" \
        --out "${out_json}" > "$(dirname "${out_json}")/tune.log" 2>&1
}

op_bench() {  # op_bench NAME ARGS...: the op benchmark with ARGS, 20 calls a timed block, under
    # BENCH_CONNECTIONS and BENCH_TIMEOUT -> $OUT/NAME.{json,png,log}; prints its exit and summary
    local name="$1"; shift
    with_connections timeout "${BENCH_TIMEOUT:-420}" "${TORCHRUN[@]}" -m megatron_flux.tools.cli bench \
        "$@" --iters 20 --out-json "${OUT}/${name}.json" --out-png "${OUT}/${name}.png" \
        > "${OUT}/${name}.log" 2>&1
    echo "   exit $? (${SECONDS}s)"; grep -A12 "^summary" "${OUT}/${name}.log" | head -14
}

for stage in "$@"; do
    echo "== ${stage} ($(date +%T), ${SECONDS}s)"
    case "${stage}" in
    main)
        use_carried_megatron
        timeout "${MAIN_TIMEOUT:-420}" bash examples/pretrain_llama.sh > "${OUT}/main.log" 2>&1
        echo "   exit $? (${SECONDS}s)"
        grep -E "megatron-flux check|iteration +[0-9]+/" "${OUT}/main.log" | cut -c1-300 | tail -8
        grep -iE "^\S*(error|Traceback)|Error:" "${OUT}/main.log" | head -5 ;;
    tests)
        # shellcheck disable=SC2086
        PYTEST_VERBOSITY="${PYTEST_VERBOSITY:--v}" gpu_tests "${TESTS_TIMEOUT:-480}" tests-gpu ${TESTS_PATHS:-} ;;
    bench)
        op_bench bench --m-set "${BENCH_M_SET:-large}" \
            --methods cublas_gemm comm nccl torch_async_tp flux auto --trials 5 ;;
    unseen)
        # shellcheck disable=SC2086
        op_bench bench-unseen \
            --model-shapes ${UNSEEN_MODELS:-qwen2.5-7b:3584:37888:18944 mistral-nemo-12b:5120:28672:14336 \
                llama2-13b:5120:27648:13824 gpt-neox-20b:6144:24576:24576} \
            --ms ${UNSEEN_MS:-256 1024 2048 4096 8192} ${UNSEEN_EXTRA:-} --methods cublas_gemm comm nccl flux auto \
            --trials 5 ;;
    ab)
        [ -f "${AB_VARIANT:-}" ] || { echo "ab: set AB_VARIANT to a JSON file of config fields"; exit 2; }
        # shellcheck disable=SC2086
        op_bench ab ${AB_CASES:---m-set ${BENCH_M_SET:-large}} \
            --methods cublas_gemm nccl flux flux_variant flux_control \
            --flux-variant "$(cat "${AB_VARIANT}")" --trials "${AB_TRIALS:-21}" ;;
    kvc)
        for op in ${KVC_OPS:-AG+GEMM GEMM+RS}; do
            name="kvc-$([ "${op}" = AG+GEMM ] && echo ag || echo rs)${KVC_NAME:+-${KVC_NAME}}"
            # shellcheck disable=SC2086
            CUDA_VISIBLE_DEVICES=0 timeout "${KVC_TIMEOUT:-240}" python3 -m megatron_flux.tools.diagnostics.kernel_vs_cublas \
                --tp "${KVC_TP:-2}" --ops "${op}" ${KVC_CASES:---m 1024 2048 4096 8192 --configs table} \
                ${KVC_EXTRA:+--extra "${KVC_EXTRA}"} --alternate --trials 7 \
                --iters 20 --warmup 10 --shuffle-seed 0 --queue-ahead-ms 5 \
                --json "${OUT}/${name}.json" > "${OUT}/${name}.log" 2>&1
            echo "   ${op}: exit $? (${SECONDS}s)"; summarize_kvc "${OUT}/${name}.json"
        done ;;
    tune)
        mkdir -p "${OUT}/tune"
        # shellcheck disable=SC2086
        tune_table "${OUT}/tune/table.json" ${TUNE_ARGS:---m-set all --max-candidates 12 --top 2}
        echo "   tune exit $? (${SECONDS}s)"; grep -E "^(ag|rs) n=" "${OUT}/tune/tune.log" | tail -20
        [ "${TUNE_BENCH:-1}" = 1 ] || continue
        MEGATRON_FLUX_CONFIG="${OUT}/tune/table.json" timeout "${BENCH_TIMEOUT:-420}" "${TORCHRUN[@]}" \
            -m megatron_flux.tools.cli bench --m-set all \
            --methods cublas_gemm comm nccl torch_async_tp flux flux_default auto --trials 5 --iters 20 \
            --out-json "${OUT}/tune/bench.json" --out-png "${OUT}/tune/bench.png" > "${OUT}/tune/bench.log" 2>&1
        echo "   bench exit $? (${SECONDS}s)"; grep -A24 "^summary" "${OUT}/tune/bench.log" | head -26 ;;
    trainshapes)
        mkdir -p "${OUT}/train"
        # shellcheck disable=SC2086
        TUNE_TIMEOUT="${TUNE_TIMEOUT:-360}" tune_table "${OUT}/train/tune.json" \
            --model-config "${train_cfg}" --ms ${train_ms} --max-candidates "${TRAIN_CANDIDATES:-16}" --top 3 \
            --time-budget-s "${TRAIN_TUNE_BUDGET:-270}"
        echo "   tune exit $? (${SECONDS}s)"; tail -2 "${OUT}/train/tune.log"
        [ -f "${OUT}/train/tune.json" ] || continue
        shipped="$(python3 -c 'import sys, torch; from megatron_flux.tuning import registry, schema; p = torch.cuda.get_device_properties(0); print(registry.SHIPPED_DIR + "/" + schema.default_filename(p.name, p.multi_processor_count, int(sys.argv[1]), "bf16"))' "${NGPUS}")"
        if [ -f "${shipped}" ]; then
            python3 -m megatron_flux.tools.tune.add "${shipped}" "${OUT}/train/tune.json" "${OUT}/train/added.json" \
                || cp "${shipped}" "${OUT}/train/added.json"
        else
            echo "   no shipped table ${shipped}: the tune is the table"; cp "${OUT}/train/tune.json" "${OUT}/train/added.json"
        fi
        # shellcheck disable=SC2086
        MEGATRON_FLUX_CONFIG="${OUT}/train/added.json" op_bench train/bench --model-config "${train_cfg}" --ms ${train_ms} \
            --methods cublas_gemm comm nccl flux auto --trials 5
        python3 -m megatron_flux.tools.tune.confirm "${OUT}/train/added.json" "${OUT}/train/bench.json" \
            "${OUT}/train/confirmed.json" ;;
    modelbench)
        # a training config's TP GEMMs with the tables as found (the shipped ones on a fresh
        # machine): what a model runs before `trainshapes` tunes it
        # shellcheck disable=SC2086
        op_bench model-bench --model-config "${train_cfg}" --ms ${train_ms} \
            --methods cublas_gemm comm nccl flux auto --trials 5 ;;
    race)
        for mode in drain no-drain; do
            # shellcheck disable=SC2046
            timeout 90 "${TORCHRUN[@]}" benchmarks/experiments/growth_race.py \
                $([ "${mode}" = no-drain ] && echo --no-drain) --sleep-cycles "${RACE_SLEEP_CYCLES:-12000000000}" \
                --out "${OUT}/race.jsonl" >> "${OUT}/race.log" 2>&1
            echo "   ${mode}: exit $? (${SECONDS}s)"
        done
        cat "${OUT}/race.jsonl" ;;
    rstrace)
        for comm in on off; do
            # shellcheck disable=SC2086
            timeout "${RSTRACE_TIMEOUT:-240}" "${TORCHRUN[@]}" benchmarks/experiments/phase_trace_tp.py \
                --op rs --comm "${comm}" --model-shapes ${RSTRACE_MODELS:-yi1.5-9b:4096:22016:11008 falcon2-11b:4096:16384:16384 starcoder2-7b:4608:18432:18432} \
                --ms ${RSTRACE_MS:-1024 2048} --json "${OUT}/rs-trace-${comm}.json" > "${OUT}/rs-trace-${comm}.log" 2>&1
            echo "   comm ${comm}: exit $? (${SECONDS}s)"; grep -E "^rs " "${OUT}/rs-trace-${comm}.log" | cut -c1-160
        done ;;
    host)
        # host time per layer call (forward + backward) of megatron-core's own linears, nccl and
        # flux, with a profile of flux's
        use_carried_megatron
        timeout "${HOST_TIMEOUT:-150}" "${TORCHRUN[@]}" benchmarks/host_overhead.py --layers \
            --ms 4096 8192 --backends megatron nccl flux --out "${OUT}/host.json" > "${OUT}/host.log" 2>&1
        echo "   exit $? (${SECONDS}s)"; grep -E "cpu issue" "${OUT}/host.log" | head -8 ;;
    sections)
        timeout "${HOST_TIMEOUT:-150}" "${TORCHRUN[@]}" benchmarks/experiments/host_sections.py \
            --out "${OUT}/sections.json" > "${OUT}/sections.log" 2>&1
        echo "   exit $? (${SECONDS}s)"; tail -30 "${OUT}/sections.log" ;;
    launchab)
        use_carried_megatron  # its megatron variant: megatron-core's own linears
        timeout "${HOST_TIMEOUT:-150}" "${TORCHRUN[@]}" benchmarks/experiments/host_launch_ab.py \
            --trials "${LAUNCHAB_TRIALS:-15}" --out "${OUT}/launch-ab.json" > "${OUT}/launch-ab.log" 2>&1
        echo "   exit $? (${SECONDS}s)"; tail -16 "${OUT}/launch-ab.log" ;;
    matrix)
        # the end-to-end matrix cells in MATRIX_CELLS (benchmarks/e2e_matrix.py; resumable)
        use_carried_megatron
        # MATRIX_RESUME: an earlier call's matrix/ folder (carried), whose finished cells and jobs are kept
        [ -n "${MATRIX_RESUME:-}" ] && mkdir -p "${OUT}/matrix" && cp -r "${MATRIX_RESUME}/." "${OUT}/matrix/"
        python3 -c 'import json, torch, triton, megatron.core as m; print(json.dumps({"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "versions": {"torch": torch.__version__, "triton": triton.__version__, "megatron_core": m.__version__}}))' > "${OUT}/matrix-meta.json"
        # shellcheck disable=SC2086
        timeout "${MATRIX_TIMEOUT:-560}" python3 benchmarks/e2e_matrix.py run ${MATRIX_CELLS:?set MATRIX_CELLS} \
            --out "${OUT}/matrix" ${MATRIX_ARGS:-} 2>&1 | tee "${OUT}/matrix.log" | tail -20 ;;
    interleave)
        SKIP_TESTS="${SKIP_TESTS:-1}" OUT="${OUT}/interleave" bash benchmarks/device_interleave.sh ;;
    e2e)
        OUT="${OUT}/e2e" bash benchmarks/e2e_device.sh ;;
    cachepack)
        pack_triton_cache ;;
    bundle)
        (cd "${OUT}" && find . -mindepth 1 -maxdepth 1 ! -name 'triton-cache.tgz.part-*' ! -name smi.csv \
            ! -name results.tgz -print0 | tar czf results.tgz --null -T - --remove-files)
        echo "   $(tar tzf "${OUT}/results.tgz" | wc -l) entries in ${OUT}/results.tgz" ;;
    *)
        echo "unknown stage ${stage}; stages: main tests bench unseen ab kvc tune trainshapes modelbench race rstrace host sections launchab matrix interleave e2e cachepack bundle"
        exit 2 ;;
    esac
done
echo "== done in ${SECONDS}s"
